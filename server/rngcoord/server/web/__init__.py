"""The HTTP side: the status page, its JSON API and sign-in (`status`), the sign-in's
sessions (`sessions`), the views it renders from the store (`views`), how they read on the
page and in the API (`present`), and their templates.

It may import the rules, the audit, storage and the base modules (the token table,
rngcoord.server.auth, included); never the gRPC side (rngcoord.server.rpc), which never
imports it either.
"""
