"""The queue core: claim under a lease, hand items to a sink, decide, settle. No SQL, no broker.

The relay (a publisher sink), the WAL relay (decisions only) and the task worker (a handler
sink) share it; a backend implements :class:`outboxkit.queue.store.QueueStore`.
"""
