"""`python -m irismesh.spark_telemetry`: see cli.py."""

import sys

from irismesh.spark_telemetry.cli import main

sys.exit(main())
