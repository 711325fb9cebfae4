"""Telemetry records: one schema for the node's writer, the compactor and Spark."""
