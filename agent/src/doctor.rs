//! `felhom-agent doctor`: the node's preflight. It writes nothing, anywhere.
