"""The rules: what the coordinator decides, over any store.

`coordinator` wires them and holds the Reserve hot path; `membership` (who calls as which
member, and the one fencing rule), `barrier` (joins) with `joins` (what a join asks and the
rules that refuse one), `grants` (Reserve), `restores`, `resizes`, `attestations`,
`divergences`, `floors` and `seeds` each hold one concern; `cache` and `feed` keep each
process's memory of the store in step with the other processes'.

They may import storage's interface and SQL (rngcoord.server.storage.store and the
*queries modules), the audit chain and the base modules; never grpc, aiohttp, psycopg,
sqlite3, a concrete store, the gRPC side or the HTTP side (`make lint` checks it).
"""
