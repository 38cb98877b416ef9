"""Callbacks: straggler detection (fail-slow), heartbeat (fail-stop), fault injection, re-planning control."""
