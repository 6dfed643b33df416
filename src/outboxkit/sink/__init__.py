"""The publisher as the queue core's sink, and what both relays share around it.

``publisher.py``: publish() and the sink (timeout, every exception a result, the one
dead-letter log line); ``observer.py``: the hooks each step reports to (stats, summary
logs, tracing; metrics subclass them); ``outage.py``: publish failures as one outage.
The polling relay (outboxkit.relay) and the WAL relay (outboxkit.cdc) both sit on it.
"""
