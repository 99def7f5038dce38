module brokertest/spiffeverify

go 1.24.0

require github.com/spiffe/go-spiffe/v2 v2.6.0

require github.com/go-jose/go-jose/v4 v4.1.2 // indirect
