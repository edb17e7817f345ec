"""Moving rollout rows between processes (docs/design.md §7): wire bodies (JSON, binary), the generate client and server."""
