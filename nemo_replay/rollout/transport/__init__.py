"""Moving rollout rows between processes (docs/design.md §7): wire envelopes, the generate client and server."""
