"""Database driver glue: what outboxkit needs from each driver, behind one small surface."""
