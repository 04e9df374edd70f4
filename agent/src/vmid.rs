//! Pure vmid policy: range, format, reserved bands and collisions → a [`VmidVerdict`].
//! It never suggests another vmid.
