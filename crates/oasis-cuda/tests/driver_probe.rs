//! Asking for the GPU never panics: on a machine without a driver the answer is
//! `DriverMissing`; on a GPU machine with no context current and no device named it is
//! `NoContext`. (Launches themselves are tested from Python on the GPU machine.)

use oasis_cuda::{driver_available, CudaError, Gpu};

#[test]
fn probing_the_driver_does_not_panic() {
    match driver_available() {
        Ok(()) => {
            // A driver and a device: attaching without a current context must ask for one.
            match Gpu::attach(None) {
                Ok(gpu) => assert!(gpu.compute_capability() >= (8, 0)),
                Err(e) => assert!(
                    matches!(e, CudaError::NoContext | CudaError::UnsupportedArch { .. }),
                    "unexpected error: {e}"
                ),
            }
        }
        Err(CudaError::DriverMissing) | Err(CudaError::Driver(_)) => {
            let e = Gpu::attach(Some(0)).unwrap_err();
            assert!(
                matches!(e, CudaError::DriverMissing | CudaError::Driver(_)),
                "{e}"
            );
            assert!(!e.to_string().is_empty());
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}
