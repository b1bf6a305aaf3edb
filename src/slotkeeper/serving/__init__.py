"""Serving one backend: a request's identity, one turn from lease to release, the backend's discovery and watch."""
