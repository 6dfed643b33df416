"""Each broker's wire format in one module: the publisher's encoder beside the consumer's decoder.

``cloudevents`` holds what they share (the decoded :class:`~.cloudevents.Envelope`,
the ``ce-*`` header encoding); ``kafka``, ``nats``, ``rabbitmq``, ``redis``, ``sqs``
and ``webhook`` hold one binding each. Pure functions over plain values: no broker
client is imported here, and neither the publishers nor the consumer runners.
"""
