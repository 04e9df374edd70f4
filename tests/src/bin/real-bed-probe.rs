//! Asks for a real guest bed as a test does (`GuestBed::new_real`) and prints which bed it got:
//! `real <link prefix>` or `busybox <reason>`. `tests/tests/real_guests.rs` runs it on a `PATH`
//! without LXC's tools, to show what a machine without LXC gets.

fn main() {
    match felhom_tests::guestbed::GuestBed::new_real() {
        Ok(bed) => println!("real {}", bed.net_prefix().unwrap_or_default()),
        Err((reason, _bed)) => println!("busybox {reason}"),
    }
}
