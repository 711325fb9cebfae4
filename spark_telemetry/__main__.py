"""`python -m irismesh.spark_telemetry`: see cli.py."""

from irismesh._exit import end_process
from irismesh.spark_telemetry.cli import main

end_process(main())
