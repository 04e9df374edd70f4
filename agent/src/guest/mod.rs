//! Work inside a guest: exec (LXC through `pct`, QEMU through the guest agent API), bootstrap
//! profiles and osquery checks.
