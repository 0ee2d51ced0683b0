"""Install hongtu: ``pip install -e .`` (tests: ``pip install -e '.[test]'``)."""

from setuptools import find_packages, setup

setup(
    name="hongtu",
    version="0.1.0",
    description="Out-of-core full-graph GNN training (HongTu, SIGMOD 2023)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hongtu", "hongtu.*"]),
    install_requires=[
        "torch>=2.3",
        "numpy>=1.24",
        "numba>=0.58",
        "pymetis>=2023.1",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "torch_geometric>=2.4", "ruff"],
        "sparse": ["torch-sparse"],
    },
    entry_points={"console_scripts": ["hongtu=hongtu.cli:main"]},
)
