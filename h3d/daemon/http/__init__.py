"""The OpenAI-compatible HTTP API of the daemon (`http_listen`): `server` (the listener, its
middleware and small routes), `schemas` (the bodies), `completions` (chat and text completions),
`responses` (stored responses as sessions)."""
