//! Wire types of the felhom agent ↔ hub websocket protocol. No IO lives here.
