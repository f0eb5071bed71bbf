"""The HTTP side: the status page, its JSON API and sign-in (`status`), the views it renders
from the store (`views`), and their templates.

It may import the rules, the audit, storage and the base modules (the token table,
rngcoord.server.auth, included); never the gRPC side (rngcoord.server.rpc), which never
imports it either.
"""
