"""Admin surface: health checks, Prometheus metrics, /services and /flows over HTTP."""
