"""The peer-memory transport: rows move between the GPUs of one host through symmetric memory."""
