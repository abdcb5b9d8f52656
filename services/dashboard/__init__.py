"""The dashboard service: serves the static page in `dashboard/` and the service URLs it polls."""
