"""rngcoord client: connection, leases and the DTensor RNG tracker."""
