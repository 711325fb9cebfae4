import sys

from irismesh.cli import main

sys.exit(main())
