"""Debugging what the compiler did to communication: dumps, the schedule report, the timeline, the CLI."""
