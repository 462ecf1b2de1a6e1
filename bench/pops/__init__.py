"""Several PoPs on one machine: network namespaces, a delaying WAN relay, and the
``pops`` benchmark scenario (local-first versus locality-blind routing, and a
PoP whose workers all die)."""
