fn main() {
    std::process::exit(ndtrain::cli::main());
}
