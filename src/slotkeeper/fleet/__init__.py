"""Several backends and hosts: placement, the session directory, trusted peers, a model's group of backends, and
the shared tier of snapshots in an object store."""
