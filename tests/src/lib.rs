//! Test bed for felhom-agent: the fakepve wrapper, the `pct` stand-in, the development hub.
