//! Asks for a real guest bed as a test does and prints which bed it got. Without an argument
//! (`GuestBed::new_real`): `real <link prefix>` or `busybox <reason>`; with `vm`
//! (`GuestBed::new_real_vm`): `real-vm` or `modelled <reason>`. `tests/tests/real_guests.rs`
//! and `tests/tests/real_vm.rs` run it on a `PATH` without LXC's tools or QEMU, to show what a
//! machine without them gets.

fn main() {
    if std::env::args().nth(1).as_deref() == Some("vm") {
        match felhom_tests::guestbed::GuestBed::new_real_vm() {
            Ok(_bed) => println!("real-vm"),
            Err((reason, _bed)) => println!("modelled {reason}"),
        }
        return;
    }
    match felhom_tests::guestbed::GuestBed::new_real() {
        Ok(bed) => println!("real {}", bed.net_prefix().unwrap_or_default()),
        Err((reason, _bed)) => println!("busybox {reason}"),
    }
}
