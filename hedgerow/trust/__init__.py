"""Hedgerow's internal trust: a cluster CA, identities in certificates, join
tokens, and the TLS contexts every internal listener and client uses.

    identity.py     who a certificate speaks for (spiffe://hedgerow/<role>/<name>)
    ca.py           the cluster CA: issues short-lived certificates
    tokens.py       join tokens and revocations (sans-IO book, persisted as JSON)
    credentials.py  one process's key, certificate and CA on disk; its live SSLContexts
    peer.py         the verified peer of the current connection, for the app
    join.py         a worker's or gateway's side: join once, renew before expiry

See docs/security.md for the threat model and how operators use them.
"""
