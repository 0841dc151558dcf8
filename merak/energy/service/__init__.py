"""The Perseus (Zeus PFO) service: the protocol, `merak energy serve` and its bounds, the client."""
