"""The request path: parsing and tokenizing a prompt, its block-key chain, routing one request
and the record of its dispatch; the error types a request can end in."""
