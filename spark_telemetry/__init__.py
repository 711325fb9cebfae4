"""Telemetry analysis on PySpark (see issue 6)."""
