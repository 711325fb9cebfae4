"""Telemetry analysis on PySpark."""
