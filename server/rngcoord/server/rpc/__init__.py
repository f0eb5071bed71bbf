"""The gRPC side: the Coordinator service (`service`) and its session stream (`session`), the
gate every call passes (`gate`: tokens, roles, rate limits), the token table (`auth`) and
the connection limits (`connections`).

A thin layer over the rules (rngcoord.server.core.coordinator): it turns requests into calls and
errors into statuses. It may import the rules, storage and the base modules; never the HTTP
side (rngcoord.server.web), which never imports it either.
"""
