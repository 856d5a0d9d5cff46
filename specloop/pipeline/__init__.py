"""Speculation: block self-speculation rounds and their device-side acceptance."""
