"""Relay prototypes for issue 9 item 6, measured side by side with the usproxy relay."""
