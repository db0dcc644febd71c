//! `lockstep`: the command line with lockstep's built-in jobs (the MLP/CNN classifiers and the
//! character-level transformer, chosen by the config). A user's own job gets the same command
//! line from `lockstep::main(MyJob)`.

fn main() {
    lockstep_cli::run(Box::new(lockstep_train::BuiltinJob))
}
