"""The audit: the hash-chained log every change appends to (`chain`), the anchors that pin
its head outside the store (`anchors`), and the offline check of a store against its chain
(`verify`).

It sits below the rules, which append to the chain inside their transactions, and above
storage, through which it reads a store. It may import storage and the base modules; never
the rules, rpc, web or the process (`rngcoord report`, which draws the status page's views,
is rngcoord.server.report, beside the CLI).
"""
