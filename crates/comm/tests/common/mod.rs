//! Helpers shared by lockstep-comm's integration tests.

/// The seconds in a "timed out after X.XXs" message. Timeout tests compare it as a number, since
/// on a loaded machine the waited time is printed as e.g. 3.01s rather than the nominal 3.00s.
pub fn waited_in_message(msg: &str) -> f64 {
    let rest =
        &msg[msg.find("timed out after ").expect("a timeout message") + "timed out after ".len()..];
    rest[..rest.find('s').expect("seconds")]
        .parse()
        .expect("a number of seconds")
}
