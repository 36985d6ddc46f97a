fn main() {
    std::process::exit(oomscope::cli::main());
}
