import sys

from hongtu.cli import main

sys.exit(main())
