//! A minimal spin lock for thread-cache slots.
//!
//! Why not `std::sync::Mutex`: a slot is locked by its owner thread on every chunk
//! acquisition and release and almost never by anyone else (trims). Uncontended, `Mutex`
//! costs two locked instructions (lock `cmpxchg`, unlock `xchg`, which it needs to learn
//! about sleeping waiters); this lock's unlock is a plain release store, which halves the
//! cost of the pool's fast path (measured: docs/performance.md, "memctl chunk pool"). The
//! rare waiter spins briefly and then yields; critical sections are a few pushes or pops.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: access to `value` is serialised by `locked` (acquire on lock, release on unlock),
// so sharing the lock between threads only ever gives one thread a `&mut T` at a time; `T`
// itself moves between threads, hence `T: Send`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self { locked: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        loop {
            if !self.locked.swap(true, Ordering::Acquire) {
                return SpinGuard { lock: self };
            }
            let mut spins = 0u32;
            while self.locked.load(Ordering::Relaxed) {
                if spins < 100 {
                    std::hint::spin_loop();
                    spins += 1;
                } else {
                    // The holder may be descheduled: let it run.
                    std::thread::yield_now();
                }
            }
        }
    }
}

pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard exists only while `locked` is held by us (set in `lock`,
        // cleared in `drop`), so no other reference to `value` exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only borrow through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}
