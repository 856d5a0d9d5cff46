"""Host-side bookkeeping, plain Python without torch: requests, plans, the scheduler, the
logical KV manager and the token-slot lifecycle."""
