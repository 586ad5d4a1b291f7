"""Shared experiment plumbing: results (JSON lines), data, rendering, absl entry glue."""
