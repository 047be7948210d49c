"""Tests of usproxy.sources: the Kubernetes API source, its reflector and the fake API server."""
