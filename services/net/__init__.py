"""The wire: the message format and its fields, the batch stream and its two ends, the verify
messages, the handshake, the sockets' settings, CURVE and the endpoints."""
