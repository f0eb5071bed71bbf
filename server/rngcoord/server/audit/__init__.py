"""The audit: the hash-chained log every change appends to (`chain`), the anchors that pin
its head outside the store (`anchors`), the offline check of a store against its chain
(`verify`), and the report drawn from it (`report`).

`chain` sits below the rules, which append to it inside their transactions; the tools above
it read a store through storage. They may import storage and the base modules; never the
rules' process wiring, rpc or web.
"""
