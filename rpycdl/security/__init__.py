"""Who may talk to a server: mutual TLS (tls), the shared-secret handshake and identities (auth),
and a team's certificates (certs); and whose a result is: sealed results (results)."""
