"""Pure planning (no I/O, no processes): manifests, the save plan (general and grid paths), the load plan."""
