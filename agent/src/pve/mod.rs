//! The typed PVE API client.
